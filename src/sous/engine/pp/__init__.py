"""Pipeline parallel serving: the model's layers split over worker processes
(`--pipeline-parallel-size`)."""
