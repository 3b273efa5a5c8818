"""The transport layer, shared by every executor and the controller.

* ``launch``: spawning ranks (locally, or under torchrun/SLURM), never leaving orphans;
* ``lifeline``: what a rank starts through multiprocessing ends when the rank ends;
* ``net``: host addresses and free ports;
* ``job``: a rank joining the job: its role, its executor's process group, the store;
* ``channel``: typed one-way channels over the job's store;
* ``resume``: the resume point a restarted job's ranks read to find where to start.
"""
