"""The learner: objectives (advantages, losses), train_step (the jitted update), dynamic_sampling
(DAPO), loop (sample -> reward -> update), metrics (metrics.jsonl, TensorBoard, FLOPs)."""
