"""The bounded command runners gpu_health and the other probes take."""

from __future__ import annotations

import pytest
from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.testing import patch_module_args

from ansible_collections.remote_gpu.trainer.plugins.module_utils._command import module_runner, subprocess_runner


@pytest.fixture
def runners():
    with patch_module_args({}):
        module = AnsibleModule(argument_spec={})
    return [subprocess_runner, module_runner(module)]


def test_output_exit_code_timeout_and_missing_binary(runners):
    for run in runners:
        assert run(["sh", "-c", "echo out; echo err >&2; exit 3"], 5) == (3, "out\n", "err\n")
        assert run(["sleep", "5"], 0.3)[0] == 124
        assert run(["/nonexistent/nvidia-smi", "-q"], 5)[0] == 127


def test_argv_is_never_a_shell_string(runners):
    for run in runners:
        rc, out, _err = run(["echo", "$(id); *"], 5)
        assert (rc, out) == (0, "$(id); *\n")
