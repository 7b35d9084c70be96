"""``jaxkv serve``: a live, steerable video stream in the browser.

  protocol  the WebSocket messages a client may send, checked field by field (docs/server.md)
  app       the Starlette app: the page, /health, /api/sessions, one WebSocket per client, one worker for the model
  cli       the command: load and compile the model, bind (127.0.0.1 unless --token), serve with uvicorn
  static/   the page (plain HTML, CSS and JavaScript; no build step)

Needs the ``serve`` extra (``pip install 'jaxkv[serve]'``: starlette, uvicorn, websockets, Pillow).
"""
