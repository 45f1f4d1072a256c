"""The serve job: the policy of `config.model` behind an OpenAI-compatible API (docs/SERVING.md).

    python -m jaxprefix.main --config=configs/serve.py:smollm2 --workdir=/tmp/serve \
        --config.serve.port=8000

Serves /v1/models, /v1/completions and /v1/chat/completions on serve.host:serve.port until
SIGTERM or Ctrl-C, then exits 0. Requests that arrive together are sampled in one call
(serving/batcher.py); the sampler's memory settings are `config.rollout`'s.
"""
from __future__ import annotations

import os
import signal
import sys

from absl import logging

from jaxprefix.sampling import RolloutSpec
from jaxprefix.serving.batcher import Batcher
from jaxprefix.serving.http_api import Api, make_app
from jaxprefix.serving.settings import ServeSettings


def run_serve(config, workdir: str) -> None:
    import uvicorn

    from jaxprefix.run_setup.policy import load_policy

    settings = ServeSettings.from_config(config)
    policy = load_policy(config, workdir)  # workdir: where source 'sft' keeps its base
    model = policy.model
    stop_ids = sorted({policy.tokenizer.eos_id, *model.config.eos_token_ids})
    keywords = RolloutSpec.from_config(config.rollout).sampler_keywords()
    for name in ("max_new_tokens", "temperature", "top_p", "top_k"):  # each request's own
        del keywords[name]
    batcher = Batcher(model, stop_ids=stop_ids, sampler_keywords=keywords,
                      max_batch_rows=settings.max_batch_rows,
                      window_s=settings.batch_window_ms / 1000,
                      max_top_logprobs=settings.max_top_logprobs, seed=config.seed,
                      chunk_steps=settings.stream_chunk_tokens)
    app = make_app(Api(batcher, policy.tokenizer, settings, policy.context_length))
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    # uvicorn re-raises the SIGTERM it shut down on once its own handler is gone; this one
    # takes it, so a stopped server exits 0 instead of dying of the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    logging.info("serving %s on http://%s:%d/v1", settings.model_name, settings.host,
                 settings.port)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not batcher.close(timeout_s=10):
        # A sampler call (a compile, a long decode) still runs, for requests already dropped:
        # nothing is left to write, and interpreter exit would wait on the device work.
        logging.warning("server stopped; a sampler call was still running, not waited for")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    logging.info("server stopped")
