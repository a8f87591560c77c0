"""The disaggregated server (python -m hisparse.serve --disaggregated): prefill workers in processes
of their own (spawned, tensors in shared memory), the decode server behind the same HTTP endpoint.
A client gets the co-located server's tokens; a worker killed mid-prompt fails that request with a
503 naming it while the others are served; shutdown leaves no process and no /dev/shm file."""
import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import aiohttp
import pytest
import torch
from test_serve_http import CHUNK, FAMILY, A, B, C, alone, new_server
from test_serving import tiny

from hisparse.engine import Engine
from hisparse.models.loading import load_model
from hisparse.models.tiny import write_tiny_checkpoint
from hisparse.serve.__main__ import main as serve_main
from hisparse.serve.app import Service, describe, serve
from hisparse.serve.prefill import PrefillPool
from hisparse.serve.worker import ServerThread
from hisparse.serving.handoff import SHARING

STALL = 96          # a prompt starting with this id stalls the stalling worker's prefill (till it is killed)


def torch_shm() -> set[str]:
    """torch's files in /dev/shm (file_system's strategy leaves them; file_descriptor's unlinks at once)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if p.name.startswith("torch_")} if shm.is_dir() else set()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def build_stalling_tiny(started: str):
    """The tests' tiny DSA model (in the spawned worker), whose prefill of a prompt starting with STALL
    writes its pid to `started` and sleeps."""
    model = tiny(FAMILY)
    prefill = model.prefill

    def stalling(ids, *args, **kw):
        if int(ids[0, 0]) == STALL:
            Path(started).write_text(str(os.getpid()))
            time.sleep(600)
        return prefill(ids, *args, **kw)
    model.prefill = stalling
    return model


def test_the_command_prefills_in_workers_serves_the_same_tokens_and_leaves_nothing(tmp_path):
    command_round_trip(tmp_path, ["--prefill-devices", "cpu,cpu"], "cpu")


@pytest.mark.gpu
def test_the_command_prefills_on_a_second_gpu_and_decodes_on_the_first(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    command_round_trip(tmp_path, ["--device", "cuda:0", "--dtype", "float32", "--prefill-devices", "cuda:1,cuda:1"],
                       "cuda:0")


@pytest.mark.gpu
def test_the_command_prefills_in_worker_processes_on_the_decode_gpu(tmp_path):
    """One GPU, the functional check of the two-GPU setting: worker processes and the server on cuda:0."""
    command_round_trip(tmp_path, ["--device", "cuda:0", "--dtype", "float32", "--prefill-devices", "cuda:0,cuda:0"],
                       "cuda:0")


def command_round_trip(tmp_path, devices: list[str], engine_device: str) -> None:
    """The command on a free port: three prompts at once (one streamed) get the tokens each gets alone
    in place; SIGTERM: exit 0, every host row free, no worker process or /dev/shm file left."""
    shm_before = torch_shm()
    checkpoint = write_tiny_checkpoint(FAMILY, tmp_path / "tiny", num_hidden_layers=2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "hisparse.serve", "--model", str(checkpoint), "--port", "0",
                             "--mode", "hisparse", "--cache-slots", "16", "--max-context", "64", "--max-batch", "2",
                             "--prefill", "reference", "--prefill-chunk", str(CHUNK), "--disaggregated", *devices],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        pids, port = [], None
        for line in proc.stderr:
            if "prefill workers ready" in line:
                pids = [int(p) for p in re.findall(r"pid (\d+)", line)]
            if match := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port and len(pids) == 2, "the command never said where it listens, or which workers it started"
        assert all(not gone(pid) for pid in pids)

        async def go():
            async with aiohttp.ClientSession() as s:
                async def one(prompt, stream=False):
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                      json={"prompt": prompt, "max_tokens": 3, "stream": stream}) as response:
                        if not stream:
                            return response.status, (await response.json())["choices"][0]["token_ids"]
                        ids = []
                        async for line in response.content:
                            if line.startswith(b"data: {"):
                                ids += json.loads(line[6:])["choices"][0]["token_ids"]
                        return response.status, ids
                return await asyncio.gather(one(A), one(B), one(C, stream=True))
        got = asyncio.run(asyncio.wait_for(go(), 120))
        engine = Engine(load_model(checkpoint, device=engine_device), "resident", chunk_size=CHUNK, prefill="reference")
        for prompt, (status, ids) in zip((A, B, C), got, strict=True):    # each prompt alone, in place
            expected = engine.generate([torch.tensor(prompt, device=engine_device)], new_tokens=3).tokens[0].tolist()
            assert status == 200 and ids == expected, prompt
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        tail = proc.stderr.read()
        assert "3 requests served" in tail and re.search(r"host rows in use 0 of \d+", tail), tail
        assert "2 prefill workers closed (0 restarted)" in tail, tail
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(gone(pid) for pid in pids), "a prefill worker outlived the server"
    assert SHARING == "file_descriptor" and torch_shm() <= shm_before, "torch files left in /dev/shm"


class Serving:
    """A ServerThread with a prefill pool behind the HTTP app, on 127.0.0.1 in a thread of its own."""

    def __init__(self, pool: PrefillPool):
        server = new_server("hisparse")
        self.worker = ServerThread(server, prefill=pool)
        self.worker.start()
        service = Service(self.worker, describe(server, "tiny", 0.05, None))
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            self.stop = asyncio.Event()

            def on_ready(port: int) -> None:
                self.url = f"http://127.0.0.1:{port}/v1/completions"
                ready.set()
            self.final = self.loop.run_until_complete(serve(service, "127.0.0.1", 0, self.stop, 5.0, on_ready))
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30)

    def shut_down(self) -> dict:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)
        return self.final


def test_a_worker_killed_mid_prompt_fails_that_request_and_the_others_are_served(tmp_path):
    shm_before = torch_shm()
    started = tmp_path / "started"
    build = partial(build_stalling_tiny, str(started))
    pool = PrefillPool([("cpu", build), ("cpu", build)], prefill_chunk=CHUNK, prefill="reference")
    try:
        pool.wait_ready(120)
        first = list(pool.pids)
        serving = Serving(pool)

        async def go():
            async with aiohttp.ClientSession() as s:
                async def one(prompt):
                    async with s.post(serving.url, json={"prompt": prompt, "max_tokens": 3}) as response:
                        return response.status, await response.json()
                stalled = asyncio.ensure_future(one([STALL, *A]))
                while not started.exists():
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.1)                         # its pid written
                os.kill(int(started.read_text()), signal.SIGKILL)
                return await stalled, await asyncio.gather(one(B), one(C))
        (status, body), others = asyncio.run(asyncio.wait_for(go(), 120))
        killed = int(started.read_text())
        assert status == 503, body
        message = body["error"]["message"]
        assert re.search(rf"prefill worker \d \(cpu, pid {killed}\) died before it handed this prompt off: its "
                         rf"process exited with code -9", message), message
        for prompt, (status, body) in zip((B, C), others, strict=True):
            assert status == 200 and body["choices"][0]["token_ids"] == alone(tuple(prompt), 3), body
        final = serving.shut_down()
        assert final["failed"] == 1 and final["served"] == 2 and final["host_rows_in_use"] == 0, final
        assert pool.restarts == 1 and killed in first and killed not in pool.pids
        every = set(first) | set(pool.pids)
    finally:
        pool.close(timeout=10)
    assert not [p for p in multiprocessing.active_children() if p.name == "hisparse-prefill"]
    assert all(gone(pid) for pid in every)
    assert torch_shm() <= shm_before, "torch files left in /dev/shm"


def test_the_disaggregated_options_are_checked(tmp_path, capsys):
    checkpoint = str(write_tiny_checkpoint(FAMILY, tmp_path / "tiny", num_hidden_layers=2))
    assert serve_main(["--model", checkpoint, "--prefill-devices", "cpu"]) == 2
    assert "argument --prefill-devices: only with --disaggregated" in capsys.readouterr().err
    assert serve_main(["--model", checkpoint, "--disaggregated", "--prefill-devices", "cpu,cuda:1"]) == 2
    assert "argument --prefill-devices: 'cuda:1' is not a cpu device as the decode server's cpu is" in \
        capsys.readouterr().err
    assert serve_main(["--model", checkpoint, "--disaggregated", "--prefill-devices", "cpu,tpu"]) == 2
    assert "argument --prefill-devices: unknown device 'tpu'" in capsys.readouterr().err
    assert serve_main(["--disaggregated"], model=tiny(FAMILY), name="tiny") == 2
    assert "argument --disaggregated: the prefill workers load --model's checkpoint" in capsys.readouterr().err


def test_a_worker_that_cannot_build_its_model_is_named_and_nothing_is_left(tmp_path):
    pool = PrefillPool([("cpu", partial(write_tiny_checkpoint, "no-such-family", str(tmp_path)))])
    try:
        pid = pool.pids[0]
        try:
            pool.wait_ready(120)
            raise AssertionError("a worker that cannot build its model was taken as ready")
        except RuntimeError as exc:
            assert re.match(rf"prefill worker 0 \(cpu, pid {pid}\): the prefill worker could not build its model: ",
                            str(exc)), exc
    finally:
        pool.close(timeout=10)
    assert gone(pid)
