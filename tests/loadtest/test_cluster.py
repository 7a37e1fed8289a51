import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path


def test_local_cluster_command_answers_a_request():
    out = subprocess.run([sys.executable, "-m", "loadtest", "cluster", "--replicas", "2",
                          "--port", "0", "--seconds", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "POST /v1/chat/completions -> 200 via http://127.0.0.1:" in out.stdout
    assert out.stdout.count("replica    http://127.0.0.1:") == 2


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def test_sigterm_stops_every_process_the_cluster_started():
    proc = subprocess.Popen([sys.executable, "-m", "loadtest", "cluster", "--replicas", "2",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put("")],
                         daemon=True).start()
        while True:  # the cluster prints this once it is serving
            line = lines.get(timeout=60)
            assert line, "the cluster exited before serving"
            if line.startswith("Ctrl-C (or SIGTERM) stops the cluster."):
                break
        children = _children(proc.pid)
        assert len(children) == 3  # two replicas and the router
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        alive = {pid for pid in children if Path(f"/proc/{pid}").exists()
                 and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]}
        assert alive == set()
    finally:
        if proc.poll() is None:  # SIGINT stops the cluster and its children even when
            proc.send_signal(signal.SIGINT)  # SIGTERM did not
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
