"""The OpenAI-compatible HTTP API over a generation engine, and the chat page (docs/serve.md).

serve(engine, host="127.0.0.1", port=8000, api_key=None)   # server.py: blocks until Ctrl-C
app = create_app(engine)                                    # routes.py: for any ASGI server

schemas      the request bodies (types, ranges, text, nulls)
errors       refusals as OpenAI-style error bodies
middleware   the API key and the body size limit (plain ASGI)
prompts      prompts to engine requests: tokenizing, fitting in the context
completions  the two generation endpoints: batches of prompts, echo, log-probabilities, limits
logprobs     log-probabilities in OpenAI's shapes
replies      whole and streamed (server-sent events) replies, cancelling on hang-up
routes       the app: routes, error handlers, the chat page (static/), /docs (docs.py), `create_app`
server       the socket, the uvicorn server, shutdown and signals: `bind`, `make_server`, `serve`
timeouts     deadlines for a request's head and body (uvicorn's h11 protocol)
"""
