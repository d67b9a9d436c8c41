"""The shipped lm-evaluation-harness tasks: one YAML per task, its JSONL data, and `local_json.load` (the
tasks' dataset loader). Point a TaskManager's include_path here (`harness.task_manager` does)."""
