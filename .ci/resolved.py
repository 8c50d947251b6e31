"""Print the packages CI installed, and fail if a new user would get other versions of them.

A new user's pip sees PyPI alone; this machine's pip also has find-links, local indexes and a
constraints file (pip.conf). So the project's requirements are resolved again as a new user's pip
would (``--isolated``: no config files, no PIP_* variables), without installing anything, and each
installed version is compared with it. Local version labels are ignored: the machine's torch is
the CPU build (+cpu) of the release a new user gets as the CUDA build, whose nvidia-* packages are
then the only extra ones. A failed resolution (no network) is said and is no failure.
"""
import json
import subprocess
import sys
import tempfile
from importlib.metadata import distributions, requires

from packaging.requirements import Requirement


def requirements(extra):
    out = []
    for text in requires("wse-cluster"):
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            req.marker = None
            out.append(str(req))
    return out


def main():
    have = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}
    print("\n".join(f"{name}=={version}" for name, version in sorted(have.items())))
    with tempfile.TemporaryDirectory() as tmp:
        report = f"{tmp}/report.json"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                               "--quiet", "--report", report, *requirements("test")], capture_output=True, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"(could not resolve as a new user would, so not compared: {last})")
            return 0
        with open(report) as f:
            fresh = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
                     for i in json.load(f)["install"]}
    older = [f"{name} {have[name]} installed, a new user gets {version}" for name, version in sorted(fresh.items())
             if name in have and have[name].split("+")[0] != version.split("+")[0]]
    extra = sorted(set(fresh) - set(have))
    print(f"{len(fresh) - len(extra)} packages are the versions a new user's pip resolves today"
          + (f"; a new user also gets {len(extra)} more (torch's CUDA build: {', '.join(extra[:3])}, ...)"
             if extra else ""))
    for line in older:
        print(f"DIFFERENT: {line}")
    return 1 if older else 0


if __name__ == "__main__":
    sys.exit(main())
