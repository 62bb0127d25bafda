"""What the tests import: configs, event factories, the cluster driver, fault tools, plug-ins.

Test modules import from here and never from one another; ``tests/conftest.py`` keeps only the
fixtures and hooks.  ``tests/unit`` starts no role process, ``tests/e2e`` does.
"""
