"""The migrating front door (`ftctl proxy`).

`serve` starts it; `frontdoor` holds its HTTP routes; `policy` runs each client request
across as many workers as it takes (`attempt` is one upstream try, `judgment` says whose
fault a failure was, `continuation` builds the body that goes on after a cut from the
request's `ledger`); `balancer` chooses the worker (least outstanding, or by prefix with
`prefix`); `fleet` holds the workers' state and the daemon's view, `board` shares it
between the processes `procs` starts; `admission` sheds load; `chunk`, `codec`,
`counting`, `chat_template` and `tally` read and write what flows through.

Moving one request's state between workers is `dynamo_ftctl.migrate`. Import-free on
purpose: each module is imported by whoever needs it, so `import dynamo_ftctl.proxy`
stays cheap.
"""

__all__: list[str] = []
