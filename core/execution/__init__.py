"""Running the model.

- ``build``: one rank's runner: its model shard, attention backend, KV cache size, sampler, proposer.
- ``model_runner``: lays a step's batch out, runs the model and samples.
- ``executor``: the ``uni``, ``mp`` and ``ray`` executors, which hold one runner per rank.
- ``distributed``, ``collectives``, ``shm_all_reduce``: tensor-parallel state and all-reduce backends.
- ``routing``: the routers that pick a replica for a request.
- ``lora_request``: ``LoRARequest``, the LoRA adapter a request runs with (``pagoda.LoRARequest``); ``lora``,
  ``lora_adapter``, ``lora_backends``: the engine's adapters, PEFT directories, the LoRA kernels.
"""
