"""Print a validated scenario as flat ``key=value`` lines for the C NVML library (fakenvml.c).

The library never parses YAML: it runs ``<python> flatten.py <scenario>`` and reads this format.

    driver.loaded=1 ... gpu_count=N
    @gpu <index> <after_s>      one block per GPU state: the base state (after_s -1), then the complete
    <key>=<value> ...           state after each timeline entry, so the library only picks the latest due block
    @end                        (missing: the output was cut short, and the library keeps its previous state)

Exit 1 with the ScenarioError message on stderr when the file is invalid.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterator, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scenario import ScenarioError, load, pci_ids, timeline_states


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value)
    return str(value).replace("\n", " ")


def flat_items(value: Any, prefix: str = "") -> Iterator[str]:
    """Mappings become dotted keys, lists a ``.count`` plus indexed keys."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flat_items(item, f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, list):
        yield f"{prefix}.count={len(value)}"
        for index, item in enumerate(value):
            yield from flat_items(item, f"{prefix}.{index}")
    else:
        yield f"{prefix}={_format(value)}"


def _gpu_lines(state: dict) -> List[str]:
    device_id, subsystem_id = pci_ids(state["name"])
    lines = list(flat_items({key: value for key, value in state.items() if key != "timeline"}))
    lines += [f"pci_device_id={device_id}", f"pci_subsystem_id={subsystem_id}"]
    return lines


def flatten(path: str) -> List[str]:
    scenario = load(path)
    lines = list(flat_items({"driver": scenario["driver"]}))
    lines.append(f"gpu_count={len(scenario['gpus'])}")
    for index, gpu in enumerate(scenario["gpus"]):
        lines.append(f"@gpu {index} -1")
        lines += _gpu_lines(gpu)
        for after_s, state in timeline_states(gpu):
            lines.append(f"@gpu {index} {after_s!r}")
            lines += _gpu_lines(state)
    lines.append("@end")
    return lines


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: flatten.py SCENARIO", file=sys.stderr)
        return 2
    try:
        lines = flatten(argv[0])
    except ScenarioError as exc:
        print(f"fakegpu: invalid scenario: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
