"""Warm-start cache keys (``streamrl.runtime.cache_keys``): contents and code, not names."""

from __future__ import annotations

import functools
import importlib
import sys

from streamrl.runtime.cache_keys import code_digest, rows_digest


def test_an_edited_demonstrations_module_is_a_new_key(tmp_path, monkeypatch):
    (tmp_path / "my_demos.py").write_text("def demonstrate(row):\n    return ['a']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_demos")
    before = code_digest(module.demonstrate)
    assert code_digest(functools.partial(module.demonstrate)) == before  # a partial: its function
    (tmp_path / "my_demos.py").write_text("def demonstrate(row):\n    return ['b']\n")
    module = importlib.reload(module)
    assert code_digest(module.demonstrate) != before  # the same name, other code
    sys.modules.pop("my_demos")


def test_code_without_a_source_file_is_keyed_by_its_compiled_form():
    namespace: dict = {}
    exec("def f(row):\n    return ['a']\n", namespace)  # a notebook cell's function
    first = code_digest(namespace["f"])
    exec("def f(row):\n    return ['b']\n", namespace)
    assert code_digest(namespace["f"]) != first


def test_rows_are_keyed_by_every_column_in_any_order():
    rows = [{"prompt": "p", "answer": "1", "unit": "cm"}, {"prompt": "q", "answer": "2"}]
    assert rows_digest(rows) == rows_digest(rows[::-1])
    assert rows_digest(rows) != rows_digest([{**rows[0], "unit": "kg"}, rows[1]])
