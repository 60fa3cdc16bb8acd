"""The script `torchrun.run_torchrun` gives torchrun (`--run-path`): each worker, forked from torchrun's agent,
runs it in its own interpreter — what `python -m course_lib.run WORKER ARGS` does in a new one."""
if __name__ == "__main__":
    from course_lib.distributed.launch import _destroy_group
    from course_lib.run import main

    main()
    _destroy_group()     # what atexit does after `python -m course_lib.run`; a forked worker ends without atexit
