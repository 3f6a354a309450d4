"""Shared test data and helpers."""

from __future__ import annotations

PROMPTS = [
    "def add(a, b):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(",
    "# Copyright 2026\n",
    "hello world",
    "if __name__ == '__main__':\n",
    "return [x * 2 for x in",
    "try:\n    import json\nexcept ImportError:\n",
    "with open(path) as f:\n",
    "The quick brown fox",
    "while True:\n    line = ",
    "x = {'a': 1, 'b': 2}\n",
    "async def fetch(url):\n",
    "raise ValueError(",
    "\"\"\"Module docstring.\"\"\"\n",
    "lambda x: x",
    "@property\ndef name(self):\n",
    "from collections import",
    "assert result ==",
    "def __repr__(self):\n        return",
    "numbers = [1, 2, 3",
]
