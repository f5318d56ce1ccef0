"""The shipped platform profiles (inventories/group_vars/<platform>.yml), as tests read them.

Import as ``from ansible_collections.remote_gpu.trainer.tests.profiles import self_stop``: a test of autostop uses
the ``self_stop`` a user's box gets, so a profile that drifts from what the code accepts fails a test.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

import yaml

from ansible_collections.remote_gpu.trainer.tests.testpaths import REPO

PROFILES = REPO / "inventories" / "group_vars"


def profile(platform: str) -> Dict[str, Any]:
    with open(PROFILES / f"{platform}.yml", encoding="utf-8") as stream:
        return yaml.safe_load(stream)


def self_stop(platform: str) -> Dict[str, Any]:
    """A fresh copy of the platform's ``self_stop`` declaration (tests may change it)."""
    return copy.deepcopy(profile(platform)["self_stop"])
