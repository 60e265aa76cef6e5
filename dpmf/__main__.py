from dpmf.cli import run

run()
