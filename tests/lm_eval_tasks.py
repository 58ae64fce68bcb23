"""A local lm-eval task for tests: lm-eval reads it from a directory, offline (no dataset hub)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path


def multiple_choice_task(where: Path) -> Path:
    """Writes task `megaroute_tiny` (3 Shakespeare continuations, accuracy) under where/tasks."""
    tasks = where / "tasks"
    tasks.mkdir()
    docs = [{"context": "First Citizen:\nYou are all resolved rather to", "choices": [" die", " eat"], "label": 0},
            {"context": "Speak, speak", "choices": ["!", "?"], "label": 0},
            {"context": "We know't, we know", "choices": ["'t.", "it."], "label": 0}]
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "megaroute_tiny.yaml").write_text(textwrap.dedent(f"""\
        task: megaroute_tiny
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tasks / 'docs.jsonl'}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{context}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: label
        metric_list:
          - metric: acc
        """))
    return tasks
