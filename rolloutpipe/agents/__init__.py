"""Multi-turn, tool-using episodes: tools as plug-ins (``tools.py``) and how calls are written
(``formats.py``); the worker runs an episode in ``engines/episode.py``."""
