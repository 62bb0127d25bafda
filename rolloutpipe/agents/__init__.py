"""Multi-turn, tool-using episodes: tools as plug-ins (``tools.py``)."""
