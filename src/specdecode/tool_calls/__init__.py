"""Tool calls as a model writes them: the families' formats (``formats.py``), the grammars that constrain a call
while it is written (``grammar.py``) and the reading of a streamed reply into content and call fragments
(``stream.py``). Nothing here knows HTTP (``serve/tools.py``) or runs a model."""
