"""omniroll's HTTP server (not on the training path): the FastAPI app (`server.create_app`: the OpenAI images API,
the safetensors rollout route, Prometheus metrics), the contract every route keeps (`contract`), what it generates
with (`backend`: an in-process engine or replicas through a `RolloutClient`), uvicorn (`runner`) and `omniroll serve`
put together (`serve`). It builds on the engine, the rollout client and the agent loop's `RolloutCluster`; nothing
below imports it."""
