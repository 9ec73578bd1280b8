"""What a worker imports: the Manager brings the lighthouse client, never the server (aiohttp's web framework,
SQLite) nor the shards' readers (pyarrow, 0.2 s of CPU), so a restarted worker rejoins without paying for them;
the lazy names still resolve."""

from __future__ import annotations

import subprocess
import sys


def test_a_worker_imports_the_client_not_the_server() -> None:
    code = (
        "import sys\n"
        "from stalwart import Manager\n"
        "from stalwart.coord import LighthouseClient\n"
        "print(sorted(m for m in ('stalwart.coord.server', 'aiohttp.web', 'sqlite3', 'pyarrow') if m in sys.modules))\n"
        "from stalwart.coord import Lighthouse\n"
        "print(Lighthouse.__module__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert run.stdout.split("\n")[:2] == ["[]", "stalwart.coord.server"], run.stdout + run.stderr
