"""After `fit`: a finished run opened again (`saved_run`), its checkpoint evaluated and run on data
(`inference`), exported (`export`), plotted (`plot`), and runs listed (`runs`).
May import config, data, engine, io, tasks, models and train's loop and precision; not train's fit.
"""
