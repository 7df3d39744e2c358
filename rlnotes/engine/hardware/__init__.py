"""The hardware section of the config: the device and its precision (devices), torch's threads
(threads), and several processes on one run (distributed; FSDP2 sharding: fsdp)."""
