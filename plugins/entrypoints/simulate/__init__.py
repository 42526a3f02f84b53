"""``pagoda simulate``: a trace-driven simulator of the engine's scheduling, timed by a calibrated cost model.

Modules: ``trace`` (the trace format and generator), ``workloads`` (the workloads of docs/benchmarks.md as traces),
``request_log`` (``pagoda serve --request-log`` and its conversion), ``cost_model`` (the step-time model),
``calibrate`` (fitting it to the real engine), ``simulator`` (the simulated engine and the replay loop),
``real`` (the same replay through the real engine), ``report`` and ``command`` (the CLI).
"""
