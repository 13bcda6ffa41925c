"""`accelerate launch` that dies with the process that started it (Linux; `rl.launch.run_stage`).

A stage must not outlive the notebook kernel that launched it: an interrupted `make study`
leaves no training process behind. The launcher's workers do the same (`rl.worker.main`).
"""

from rlxf_utils.processes import die_with_parent

if __name__ == "__main__":
    import os

    die_with_parent()
    os.environ["RLXF_PARENT_PID"] = str(os.getpid())  # its workers die with it in turn
    from accelerate.commands.launch import main

    main()
