"""Compile a Triton kernel for sm_90 without a GPU and read what the compiled program does (no
device time): SASS instruction counts and resource usage (registers, local memory) through the
cuobjdump that ships with Triton's NVIDIA backend. Counts are static (instructions in the program, not
executed); the Triton here may differ from the GPU machine's. Used by experiments/tools/sass_resolve.py and
experiments/tools/sass_dsa.py. Without a GPU run them as `TRITON_INTERPRET=0 python -m ...`: kernels_triton
otherwise defines its kernels for the interpreter, which cannot compile them."""
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(kernel, signature: dict, constexprs: dict, divisible: list[int], **options):
    """The kernel compiled for sm_90a as a launch would specialise it: the arguments at `divisible`
    (positions in `signature`) 16-byte aligned or divisible by 16."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("the kernels were defined for Triton's interpreter: run with TRITON_INTERPRET=0 to compile "
                         "them for sm_90")
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_ops(compiled) -> collections.Counter:
    """Opcode -> count in the kernel's SASS; "vec16B" counts the 16-byte global loads and stores."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
            ops["vec16B"] += bool(re.match(r"(LDG|STG)\.E\.128", m.group(1)))
    return ops


def main_loop_ops(sass: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode -> count) of a kernel's main loop in its SASS text: the span of its widest
    backward branch before the first EXIT (static counts: one trip of the loop's body)."""
    program = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            program.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())))
    end = min((a for a, text in program if text.startswith("EXIT")), default=float("inf"))
    loop = None
    for addr, text in program:
        branch = re.match(r"U?BRA\S*\s+0x([0-9a-f]+)", text)
        if branch and addr <= end and int(branch.group(1), 16) < addr:
            if loop is None or addr - int(branch.group(1), 16) > loop[1] - loop[0]:
                loop = (int(branch.group(1), 16), addr)
    if loop is None:
        return 0, collections.Counter()
    body = [text for a, text in program if loop[0] <= a <= loop[1]]
    return len(body), collections.Counter(text.split()[0].split(".")[0] for text in body)


def registers_and_spills(compiled) -> tuple[int, int]:
    """(registers per thread, bytes per thread of stack and local memory: where registers spill) from
    the cubin's resource usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    spilled = sum(int(n) for n in re.findall(r"(?:STACK|LOCAL):(\d+)", usage))
    return int(regs.group(1)) if regs else -1, spilled
