"""The chat pipeline and what it is made of: each API parses its body into one ChatCall
(request.py), the pipeline runs it (pipeline.py), and the API's renderer frames the answer
(render.py)."""
