import subprocess
import sys


def test_local_cluster_command_answers_a_request():
    out = subprocess.run([sys.executable, "-m", "loadtest", "cluster", "--replicas", "2",
                          "--port", "0", "--seconds", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "POST /v1/chat/completions -> 200 via http://127.0.0.1:" in out.stdout
    assert out.stdout.count("replica    http://127.0.0.1:") == 2
