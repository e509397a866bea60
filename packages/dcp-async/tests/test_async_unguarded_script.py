"""A script that saves at its top level, without ``if __name__ == "__main__":``.

The writer process is started with multiprocessing's ``spawn``, which imports the main
script again in the new process; there the script's top-level save tries to start a
process while bootstrapping and the writer dies at once.  The trainer must be told that
it died while starting and why, not that it timed out (``start_writer`` said "was not
ready within 600 s" the moment the writer exited) nor only an exit code.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from hyper_parallel_dcp.async_persist import async_save, start_writer
    from hyper_parallel_dcp.async_persist import AsyncSaveError
    from hyper_parallel_dcp.core.errors import CheckpointTimeoutError

    ckpt, how = sys.argv[1], sys.argv[2]
    try:
        if how == "start_writer":
            start_writer(wait=True, timeout=600)
        elif how == "prestarted":
            # started ahead (as CheckpointManager does), dead of the re-run by the time the
            # first save comes: that save says so itself, before staging anything
            from hyper_parallel_dcp.async_persist.persist import _get_persister
            start_writer()
            proc = _get_persister().writer.proc
            proc.join(timeout=300)
            try:
                response = async_save({"w": torch.arange(6.0)}, checkpoint_id=ckpt)
            except AsyncSaveError as exc:
                print(f"RESULT {type(exc).__name__}: {exc}", flush=True)
                # the next save starts a fresh writer (which dies the same way, after the save)
                try:
                    async_save({"w": torch.arange(6.0)}, checkpoint_id=ckpt).get_result(timeout=600)
                except AsyncSaveError as again:
                    print(f"NEXT {again}", flush=True)
                sys.exit(0)
            print("RESULT returned", flush=True)
            response.get_result(timeout=600)
        else:
            async_save({"w": torch.arange(6.0)}, checkpoint_id=ckpt).get_result(timeout=600)
        print("RESULT landed", flush=True)
    except (AsyncSaveError, CheckpointTimeoutError) as exc:  # not the copy's RuntimeError: it must die of it
        print(f"RESULT {type(exc).__name__}: {exc}", flush=True)
''')


@pytest.mark.parametrize("how", ["start_writer", "async_save", "prestarted"])
def test_a_writer_that_dies_starting_says_why(tmp_path, how):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), how], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    # the parent's line, not the re-imported copy's (which dies before printing)
    results = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 1, (out.stdout, out.stderr)
    result = results[0]
    assert result.startswith("RESULT AsyncSaveError: "), result
    assert "while starting" in result if how != "async_save" else "did not land" in result
    if how == "prestarted":
        assert "was not started" in result, result
        assert [line for line in out.stdout.splitlines() if line.startswith("NEXT")], out.stdout
    assert "died before serving any request" in result and 'if __name__ == "__main__":' in result, result
    assert "not ready within" not in result
    # the writer's own error is where the message says it is
    assert "bootstrapping phase" in out.stderr
    assert not (tmp_path / "ckpt" / ".metadata").exists()
