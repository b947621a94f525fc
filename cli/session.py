"""The interactive session: prompt lines in, images out, models kept across prompts.

    vramgraph session [--models DIR] [--vram 12GiB]      (or plain `vramgraph`)

A line is a prompt, optionally starting with a size (`768x512 a red fox`). Commands: !seed N,
!size WxH, !steps N (`!steps` alone: the default), !guidance G, !ref PATH (add a reference image;
`!ref` alone clears them), !lora FILE[:STRENGTH] (add a LoRA, a path or a name in loras/; `!lora` alone
clears them), !save DIR, !help, !quit. Each prompt is planned with the residency the
previous one left, so a model that stayed on the GPU is not loaded again; after each image the session
says what was loaded or freed and how long it took. The seed goes up by one after every image.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api.pipeline import check_generate
from ..nodes.output import next_counter

HELP = __doc__.split("\n\n", 2)[2]
SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\b\s*")


def describe_moves(events: list) -> str:
    loaded = [e.model.split(":")[0].replace("_", " ") for e in events if e.kind == "load"]
    freed = [e.model.split(":")[0].replace("_", " ") for e in events if e.kind == "unload"]
    parts = ([f"loaded {', '.join(loaded)}"] if loaded else []) + ([f"freed {', '.join(freed)}"] if freed else [])
    return "; ".join(parts) or "no model moved"


@dataclass
class Session:
    """State of an interactive session over a Pipeline (api/pipeline.py); `handle(line, say)` shows its messages."""

    pipe: Any
    width: int = 1024
    height: int = 1024
    seed: int = 0
    steps: int | None = None
    guidance: float | None = None
    save_dir: Path = field(default_factory=lambda: Path("output"))
    references: list[Path] = field(default_factory=list)
    loras: list[tuple[str, float]] = field(default_factory=list)
    done: bool = False

    def handle(self, line: str, say: Callable[[str], None]) -> None:
        line = line.strip()
        if not line:
            return
        if line.startswith("!"):
            self._command(line[1:].split(None, 1), say)
            return
        m = SIZE.match(line)
        width, height = self.width, self.height
        if m:
            width, height, line = int(m.group(1)), int(m.group(2)), line[m.end():]
            if not line:
                raise ValueError("a size must be followed by a prompt, e.g. 768x512 a red fox")
        self._generate(line, width, height, say)

    def _command(self, parts: list[str], say: Callable[[str], None]) -> None:
        cmd, arg = parts[0].lower(), (parts[1].strip() if len(parts) > 1 else "")
        if cmd in ("quit", "exit", "q"):
            self.done = True
        elif cmd == "help":
            say(HELP)
        elif cmd == "seed":
            check_generate(width=self.width, height=self.height, steps=None, guidance=None, seed=_int(arg, "!seed"),
                           spell={"seed": "!seed"})
            self.seed = int(arg)
        elif cmd == "steps":
            steps = _int(arg, "!steps") if arg else None
            check_generate(width=self.width, height=self.height, steps=steps, guidance=None, seed=None,
                           spell={"steps": "!steps"})
            self.steps = steps
        elif cmd == "guidance":
            try:
                guidance = float(arg)
            except ValueError:
                raise ValueError(f"!guidance {arg}: write a number, e.g. !guidance 4") from None
            check_generate(width=self.width, height=self.height, steps=None, guidance=guidance, seed=None,
                           spell={"guidance": "!guidance"})
            self.guidance = guidance
        elif cmd == "size":
            m = SIZE.match(arg)
            if not m or m.end() != len(arg):
                raise ValueError(f"!size {arg}: write WxH, e.g. !size 768x512")
            width, height = int(m.group(1)), int(m.group(2))
            check_generate(width=width, height=height, steps=None, guidance=None, seed=None,
                           spell={"width": "!size width", "height": "!size height"})
            self.width, self.height = width, height
        elif cmd == "ref":
            if not arg:
                self.references.clear()
                say("references cleared")
                return
            path = Path(arg).expanduser()
            if not path.is_file():
                raise ValueError(f"!ref {arg}: no such file")
            self.references.append(path)
        elif cmd == "lora":
            if not arg:
                self.loras.clear()
                say("LoRAs cleared")
                return
            from .main import lora_arg

            lora = lora_arg(arg)
            self.pipe.resolve_loras([lora], "!lora")  # a missing file or a bad strength is refused now
            self.loras.append(lora)
        elif cmd == "save":
            self.save_dir = Path(arg).expanduser()
        else:
            raise ValueError(f"unknown command !{cmd}; !help lists them")
        if cmd not in ("quit", "exit", "q", "help"):
            say(f"seed {self.seed}, size {self.width}x{self.height}, steps {self.steps or 'default'}, "
                f"guidance {self.guidance if self.guidance is not None else 'default'}, "
                f"{len(self.references)} reference(s), {len(self.loras)} LoRA(s), saving to {self.save_dir}")

    def _generate(self, text: str, width: int, height: int, say: Callable[[str], None]) -> None:
        ledger = self.pipe.engine.ledger
        mark = ledger.events.mark()
        t0 = time.perf_counter()
        made = self.pipe.generate(text, seed=self.seed, width=width, height=height, steps=self.steps,
                                  guidance=self.guidance, images=list(self.references), loras=list(self.loras),
                                  spell={"width": "size width", "height": "size height", "loras": "!lora"})
        seconds = time.perf_counter() - t0
        self.save_dir.mkdir(parents=True, exist_ok=True)
        saved = []
        for p in made.paths:
            stem = p.name.rsplit("_", 2)[0]  # ComfyUI's {prefix}_{counter:05}_.png
            target = self.save_dir / f"{stem}_{next_counter(self.save_dir, stem):05}_.png"
            shutil.move(str(p), target)
            saved.append(target)
        say(f"{', '.join(map(str, saved))}  seed {made.seed}, {seconds:.2f} s; "
            f"{describe_moves(ledger.events.since(mark))}")
        self.seed += 1


def _int(text: str, option: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{option} {text}: write a whole number") from None


def repl(session: Session, read: Callable[[str], str] = input, say: Callable[[str], None] = print) -> int:
    say("vramgraph session: type a prompt, or !help")
    while not session.done:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            say("")
            break
        try:
            session.handle(line, say)
        except Exception as e:  # the session goes on after a bad line or a failed image
            from ..graph.workflow.errors import one_line

            say(f"error: {one_line(e)}")
    return 0
