"""The shipped tasks' dataset loader (their `custom_dataset`): a JSON/JSONL file per split.

The harness calls it with the task's `dataset_kwargs` (and metadata); relative `data_files` are
taken from this folder, so the tasks run from a checkout or an installed package, offline.
"""
import pathlib

import datasets

HERE = pathlib.Path(__file__).resolve().parent


def load(data_files: dict, **_):
  """{split: file} -> the DatasetDict of `datasets.load_dataset('json', ...)`."""
  files = {split: str(HERE / path) for split, path in data_files.items()}
  return datasets.load_dataset("json", data_files=files)
