"""scripts/config_road.py, the measure of issue 46's config road: a call into a module already on
the call stack below its caller's module is a climb back, a call from the module itself is not,
and the road lists files in first-visit order with their calls."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from config_road import road  # noqa: E402


def test_a_call_back_into_a_module_below_on_the_stack_climbs_back(tmp_path, monkeypatch):
    (tmp_path / "hub.py").write_text(
        "import sys\n"
        "import spoke\n"
        "from config_road import _climbs\n"
        "ROOT = ''\n"
        "def start():\n"
        "    return spoke.middle()\n"
        "def back():\n"
        "    return _climbs(sys._getframe(), ROOT)\n"
        "def own():\n"
        "    return back()\n"
    )
    (tmp_path / "spoke.py").write_text("import hub\ndef middle():\n    return hub.back()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hub = importlib.import_module("hub")
    hub.ROOT = str(tmp_path) + "/"
    assert hub.start() is True  # hub -> spoke -> hub
    assert hub.own() is False  # hub -> hub: the module calling itself


def test_the_road_counts_files_calls_and_climbs():
    calls = [("run/a.py", "f", False), ("run/b.py", "g", False), ("run/a.py", "h", True)]
    found = road(calls)
    assert found["road"] == [{"file": "run/a.py", "calls": 2}, {"file": "run/b.py", "calls": 1}]
    assert (found["files"], found["folders"], found["calls"], found["climbs_back"]) == (2, 1, 3, 1)
    assert found["climbs"] == ["run/a.py: h"]
