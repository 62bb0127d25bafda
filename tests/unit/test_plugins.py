"""Plug-in paths: a module moved in 0.2 is still found under its 0.1 name, with a warning."""

import re

import pytest

from rolloutpipe.errors import ConfigError
from rolloutpipe.plugins import MOVED, current_path, import_string
from rolloutpipe.tasks import datasets, verifiers


def test_an_old_module_path_loads_the_new_object_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match="rolloutpipe.tasks.datasets:digit_ops"):
        fn = import_string("rolloutpipe.workers.task:digit_ops")
    assert fn is datasets.digit_ops
    with pytest.warns(DeprecationWarning):
        assert import_string("rolloutpipe.workers.verifiers.exact_match") is verifiers.exact_match


def test_the_longest_moved_prefix_wins() -> None:
    with pytest.warns(DeprecationWarning):
        assert current_path("rolloutpipe.workers.policies.pool:x") == "rolloutpipe.scheduling.leases:x"
    with pytest.warns(DeprecationWarning):
        new = current_path("rolloutpipe.workers.policies:make_policy")
    assert new == "rolloutpipe.scheduling:make_policy"


def test_current_paths_pass_unchanged_and_every_new_module_imports(recwarn: pytest.WarningsRecorder) -> None:
    assert current_path("rolloutpipe.tasks.datasets:digit_ops") == "rolloutpipe.tasks.datasets:digit_ops"
    assert current_path("my_project.reward:score") == "my_project.reward:score"
    assert not recwarn.list
    import importlib

    for new in MOVED.values():
        if not new.endswith(("vllm_engine", "vllm_ext", "ds_backend")):  # optional dependencies
            importlib.import_module(new)


def test_a_path_that_is_neither_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=re.escape("cannot import 'rolloutpipe.tasks.datasets:nope'")):
        import_string("rolloutpipe.tasks.datasets:nope")
