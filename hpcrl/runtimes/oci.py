"""What Podman and Docker share: the OCI client CLI (`run --rm`, `-e NAME`, `-v`, `build`,
`pull`, `rm -f`). Each has its own module naming itself and how to tell it runs a process."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from hpcrl.runtimes.base import ContainerCommand, Runtime, binary_of

if TYPE_CHECKING:
    from hpcrl.profiles import ContainerConfig


class OciRuntime(Runtime):
    """`-e NAME` passes each variable by name (the client reads the value from its own
    environment), so values never appear in the argv."""

    image_help = "registry reference or local tag"

    def run(self, c: ContainerConfig, argv: Sequence[str], values: Mapping[str, str],
            binds: Sequence[str], workdir: str | None, name: str | None) -> ContainerCommand:
        out = [binary_of(c), "run", "--rm"]
        if name:
            out += ["--name", name]
        if c.network_host:
            out.append("--network=host")
        if c.pid_host:
            out.append("--pid=host")
        if c.ipc_host:
            out.append("--ipc=host")
        if c.shm_size:
            out.append(f"--shm-size={c.shm_size}")
        if c.privileged:
            out.append("--privileged")
        out += [f"--device={d}" for d in c.devices]
        out += [f"--group-add={g}" for g in c.group_add]
        out += [f"--cap-add={cap}" for cap in c.cap_add]
        out += [f"--security-opt={s}" for s in c.security_opt]
        for b in binds:
            out += ["-v", b if ":" in b else f"{b}:{b}"]
        if workdir:
            out += ["-w", workdir]
        for n in values:
            out += ["-e", n]
        argv_out = (*out, *c.extra_flags, str(c.image), *argv)
        return ContainerCommand(argv_out, dict(values))

    def pull(self, c: ContainerConfig, source: str | None) -> ContainerCommand:
        return ContainerCommand((binary_of(c), "pull", source or str(c.image)), {})

    def build(self, c: ContainerConfig, recipe: str, context: str) -> ContainerCommand:
        args = [a for k, v in c.build_args.items() for a in ("--build-arg", f"{k}={v}")]
        return ContainerCommand(
            (binary_of(c), "build", *args, "-f", recipe, "-t", str(c.image), context), {})

    def image_problem(self, c: ContainerConfig, run: Callable[[Sequence[str]], int]) -> str | None:
        """A `localhost/` tag exists only in this node's store (nothing can pull it): it must be
        there. Other references are pulled by `run` on first use."""
        image = str(c.image)
        if not image.startswith("localhost/"):
            return None
        if run([binary_of(c), "image", "inspect", "--format", "{{.Id}}", image]) == 0:
            return None
        return (f"the container image `{image}` is not in {binary_of(c)}'s image store on this "
                "node (a `localhost/` tag cannot be pulled): build or load it on every node "
                "(`hpcrl image build|pull --site ...`)")

    def remove(self, binary: str, name: str) -> list[str] | None:
        """A killed `run` client leaves its container running: remove it by name."""
        return [binary, "rm", "-f", "--ignore", name]
