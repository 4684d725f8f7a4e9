"""What a device's executor reports while it runs its actions (the drive loop and the pieces that wait read it).

``BLOCKED``: waiting for a message or an agreement another device of this process has not reached yet;
``DONE``: an action finished; ``STEPPED``: a STEP finished, so a mini-batch's result can be reported.
"""
BLOCKED, DONE, STEPPED = "blocked", "done", "stepped"
