# nbgrader's Validate button (the toolbar of a lab in `make lab`) reads this file from the folder JupyterLab was
# started in. Lab checks launch real ranks: give each cell minutes, not nbgrader's default 30 s, so a correct answer
# is not failed for its time. Instructors grade in a course folder of their own (tools/make_labs.py --nbgrader).
c = get_config()  # noqa: F821
c.Execute.timeout = 600
