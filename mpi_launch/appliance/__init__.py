"""The appliance: a service owning a pool of emulated CS-2s that queues, runs and restarts users' jobs
(``service``), its record of jobs (``store``), one attempt of a job (``runner``), the client side
(``client``) and the hand-over of jobs to Slurm (``slurm``). docs/design.md section 11."""
