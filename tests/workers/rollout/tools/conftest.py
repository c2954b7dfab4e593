import asyncio

import pytest

from hybridflow.utils.sandbox import run_python


@pytest.fixture(scope="session")
def sandbox_available():
    """Skips only where the kernel refuses the namespaces (not root and no user namespaces, or a
    container without CAP_SYS_ADMIN); any other failure of a trivial run fails the test."""
    result = asyncio.run(run_python("print('ok')"))
    error = result.isolation.get("error", "")
    if "cannot create the sandbox's namespaces" in error:
        pytest.skip(f"the sandbox cannot run on this machine: {error}")
    assert (result.stdout, result.exit_code) == ("ok\n", 0), result
