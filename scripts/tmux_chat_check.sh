#!/usr/bin/env bash
# Real-terminal check of `edgellm chat`: run it under tmux on the bundled model (no -m), ask a
# question with send-keys, and check with capture-pane that an answer and a tok/s figure appear,
# then that Ctrl+Q exits cleanly (code 0).
#
#   scripts/tmux_chat_check.sh              # check only
#   scripts/tmux_chat_check.sh --save-docs  # also write docs/chat.svg (F12 screenshot) and docs/chat.txt
#
# Env: EDGELLM (the command, default .venv/bin/edgellm), ARGS (extra chat options, default -n 48),
# QUESTION, QUESTION2 (the follow-up asked with --save-docs), EXPECT (a word the answer must
# contain, default Paris; empty: any answer), TIMEOUT (seconds per wait, default 180).
# The last line says PASS or FAIL; exit 0 = pass, 1 = fail, 2 = cannot run (no tmux, no edgellm).
set -uo pipefail
cd "$(dirname "$0")/.."

EDGELLM=${EDGELLM:-.venv/bin/edgellm}
ARGS=${ARGS:--n 48}
QUESTION=${QUESTION:-What is the capital of France?}
QUESTION2=${QUESTION2:-And what is it famous for?}
EXPECT=${EXPECT-Paris}
TIMEOUT=${TIMEOUT:-180}
SAVE_DOCS=0
[[ "${1:-}" == "--save-docs" ]] && SAVE_DOCS=1

command -v tmux >/dev/null || { echo "SKIP: tmux is not installed (apt-get install -y tmux)" >&2; exit 2; }
[[ -x "$EDGELLM" ]] || { echo "SKIP: $EDGELLM not found: run make install" >&2; exit 2; }

SESSION="edgellm-chat-check-$$"
WORK=$(mktemp -d)
START=$SECONDS
cleanup() { tmux kill-session -t "$SESSION" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

# A private data dir (the check must not touch the user's chats); F12 saves the screenshot to $WORK.
# The pane's shell reports the exit code, then stays so that the last screen can still be captured.
tmux new-session -d -s "$SESSION" -x 110 -y 34 \
    "env EDGELLM_DATA_DIR='$WORK/data' EDGELLM_SCREENSHOT='$WORK/chat.svg' TERM=xterm-256color \
     $EDGELLM chat $ARGS; echo \"[edgellm exited with \$?]\"; sleep 3600" \
    || { echo "FAIL: cannot start a tmux session" >&2; exit 1; }

pane() { tmux capture-pane -p -J -t "$SESSION" 2>/dev/null; }

fail() {  # fail MESSAGE [SCREEN]
    echo "--- the screen ---" >&2
    printf '%s\n' "${2:-$(pane)}" >&2
    echo "FAIL: $1 ($((SECONDS - START)) s)" >&2
    exit 1
}

wait_for() {  # wait_for REGEX WHAT: poll the pane until REGEX shows, the app exits, or TIMEOUT
    local deadline=$((SECONDS + TIMEOUT)) screen
    while :; do
        screen=$(pane)
        grep -Eq -- "$1" <<<"$screen" && return 0
        grep -q "\[edgellm exited with" <<<"$screen" && fail "edgellm exited while waiting for $2" "$screen"
        ((SECONDS > deadline)) && fail "no $2 after ${TIMEOUT} s" "$screen"
        sleep 0.5
    done
}

wait_for "Ask anything" "chat screen (model loaded)"
echo "chat open after $((SECONDS - START)) s"
tmux send-keys -t "$SESSION" -l "$QUESTION"
tmux send-keys -t "$SESSION" Enter
# The answer's footer ("N tokens · X tok/s · TTFT Y s") appears when the answer is complete.
wait_for "[0-9]+ tokens · [0-9]+\.[0-9] tok/s · TTFT [0-9.]+ s" "finished answer"
sleep 0.5  # the status bar is refreshed right after the footer
screen=$(pane)

problems=()
grep -Eq "TTFT [0-9]+\.[0-9]{3} s · [0-9]+\.[0-9] tok/s" <<<"$screen" || problems+=("no TTFT/tok/s figures in the status bar")
grep -Eq "ctx [0-9]+/[0-9]+ · KV " <<<"$screen" || problems+=("no context/KV figures in the status bar")
grep -Fq "$QUESTION" <<<"$screen" || problems+=("the question is not shown")
[[ -z "$EXPECT" ]] || grep -Fq "$EXPECT" <<<"$screen" || problems+=("the answer does not mention '$EXPECT'")

if ((SAVE_DOCS)); then
    # a follow-up, so the picture shows the second turn reusing the first one's KV prefix
    tmux send-keys -t "$SESSION" -l "$QUESTION2"
    tmux send-keys -t "$SESSION" Enter
    wait_for "[0-9]+ new \+ [1-9][0-9]* reused · [0-9]+ tokens \(" "finished second answer"
    sleep 0.5
    screen=$(pane)
    tmux send-keys -t "$SESSION" F12
    for _ in $(seq 40); do [[ -s "$WORK/chat.svg" ]] && break; sleep 0.25; done
    if [[ -s "$WORK/chat.svg" ]]; then
        mkdir -p docs && cp "$WORK/chat.svg" docs/chat.svg && echo "saved docs/chat.svg"
        printf '%s\n' "$screen" > docs/chat.txt && echo "saved docs/chat.txt"
    else
        problems+=("F12 did not save a screenshot")
    fi
fi

tmux send-keys -t "$SESSION" C-q
deadline=$((SECONDS + 30))
until grep -q "\[edgellm exited with" <<<"$(pane)"; do
    ((SECONDS > deadline)) && { problems+=("Ctrl+Q did not exit within 30 s"); break; }
    sleep 0.25
done
code=$(pane | sed -n 's/.*\[edgellm exited with \([0-9]*\)\].*/\1/p' | tail -1)
[[ -z "$code" || "$code" == 0 ]] || problems+=("edgellm exited with code $code after Ctrl+Q")

echo "--- the screen after the answer ---"
printf '%s\n' "$screen"
if ((${#problems[@]})); then
    for p in "${problems[@]}"; do echo "FAIL: $p" >&2; done
    echo "FAIL ($((SECONDS - START)) s)" >&2
    exit 1
fi
echo "PASS: answer and tok/s shown in a real terminal, clean exit ($((SECONDS - START)) s)"
