"""Act: the executor, the ansible-runner bridge and playbook versions."""
