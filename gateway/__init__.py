"""The OpenAI-compatible HTTP gateway onto the queue (`plurai gateway`): app.py (the
endpoints), openai.py (request and response shapes), models.py (what the live workers
serve), auth.py (API keys and quotas), metrics.py, serve.py (the command)."""
