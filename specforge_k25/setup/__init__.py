"""A run's setup, upstream of training, evaluation, the plan CLI and the TP-node CLI: config ->
target folder, facts, capture points, dataset, draft config, target spec and stream."""
