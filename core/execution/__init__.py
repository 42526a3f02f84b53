"""Running the model: the model runner, executors, tensor-parallel collectives, replica routers."""
