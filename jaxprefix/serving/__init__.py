"""The OpenAI-compatible server over the sampler (docs/SERVING.md): settings.py (config.serve),
batcher.py (requests arriving together sampled in one call), http_api.py (the endpoints),
requests.py (their bodies), gate.py (key, limits, clients that leave), streamed.py and
streaming.py (`stream: true`)."""
