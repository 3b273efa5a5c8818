"""The runtime, shared by every executor and the controller: ranks, the job, channels.

* ``launch``: spawning ranks (locally, or under torchrun/SLURM), never leaving orphans;
* ``lifeline``: what a rank starts through multiprocessing ends when the rank ends;
* ``net``: host addresses and free ports;
* ``job``: a rank joining the job: its role, its executor's process group, the store;
* ``channel``: typed one-way channels over the job's store (``codec``: their wire format;
  ``secret``: the job's key).
"""
