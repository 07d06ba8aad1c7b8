#!/usr/bin/env bash
# Real-terminal check of `edgellm chat`: run it under tmux on the bundled model (no -m), ask a
# question with send-keys, and check with capture-pane that an answer and a tok/s figure appear.
#
#   scripts/tmux_chat_check.sh              # check only
#   scripts/tmux_chat_check.sh --save-docs  # also write docs/chat.svg (F12 screenshot) and docs/chat.txt
#
# Env: EDGELLM (the command, default .venv/bin/edgellm), QUESTION, EXPECT (a word the answer must
# contain, default Paris), TIMEOUT (seconds per wait, default 180). Exit 0 = pass.
set -euo pipefail
cd "$(dirname "$0")/.."

EDGELLM=${EDGELLM:-.venv/bin/edgellm}
QUESTION=${QUESTION:-What is the capital of France?}
EXPECT=${EXPECT:-Paris}
TIMEOUT=${TIMEOUT:-180}
SAVE_DOCS=0
[[ "${1:-}" == "--save-docs" ]] && SAVE_DOCS=1

command -v tmux >/dev/null || { echo "tmux is not installed (apt-get install -y tmux)" >&2; exit 2; }
[[ -x "$EDGELLM" ]] || { echo "$EDGELLM not found: run make install" >&2; exit 2; }

SESSION="edgellm-chat-check-$$"
WORK=$(mktemp -d)
trap 'tmux kill-session -t "$SESSION" 2>/dev/null || true; rm -rf "$WORK"' EXIT

# A private data dir (the check must not touch the user's chats); F12 saves the screenshot to $WORK.
tmux new-session -d -s "$SESSION" -x 110 -y 34 \
    "env EDGELLM_DATA_DIR='$WORK/data' EDGELLM_SCREENSHOT='$WORK/chat.svg' TERM=xterm-256color \
     '$EDGELLM' chat -n 48; echo \"[edgellm exited with \$?]\"; sleep 600"

pane() { tmux capture-pane -p -J -t "$SESSION"; }

wait_for() {  # wait_for REGEX WHAT
    local deadline=$((SECONDS + TIMEOUT))
    until pane | grep -Eq -- "$1"; do
        if ((SECONDS > deadline)); then
            echo "FAIL: no $2 after ${TIMEOUT}s; the screen:" >&2
            pane >&2
            exit 1
        fi
        if pane | grep -q "edgellm exited"; then
            echo "FAIL: edgellm exited while waiting for $2; the screen:" >&2
            pane >&2
            exit 1
        fi
        sleep 0.5
    done
}

wait_for "Ask anything" "chat screen (model loaded)"
tmux send-keys -t "$SESSION" -l "$QUESTION"
tmux send-keys -t "$SESSION" Enter
# The answer's footer ("N tokens · X tok/s · TTFT Y s") appears when the answer is complete.
wait_for "[0-9]+ tokens · [0-9]+\.[0-9] tok/s · TTFT [0-9.]+ s" "finished answer"
screen=$(pane)

status=0
grep -Eq "TTFT [0-9]+\.[0-9]{3} s · [0-9]+\.[0-9] tok/s" <<<"$screen" || { echo "FAIL: no TTFT/tok/s figures in the status bar" >&2; status=1; }
grep -Fq "$QUESTION" <<<"$screen" || { echo "FAIL: the question is not shown" >&2; status=1; }
grep -Fq "$EXPECT" <<<"$screen" || { echo "FAIL: the answer does not mention '$EXPECT'" >&2; status=1; }

if ((SAVE_DOCS)); then
    tmux send-keys -t "$SESSION" F12
    for _ in $(seq 40); do [[ -s "$WORK/chat.svg" ]] && break; sleep 0.25; done
    [[ -s "$WORK/chat.svg" ]] || { echo "FAIL: F12 did not save a screenshot" >&2; status=1; }
    if [[ -s "$WORK/chat.svg" ]]; then
        cp "$WORK/chat.svg" docs/chat.svg
        echo "saved docs/chat.svg"
    fi
    printf '%s\n' "$screen" > docs/chat.txt
    echo "saved docs/chat.txt"
fi

tmux send-keys -t "$SESSION" C-q
wait_for "edgellm exited with 0" "clean exit (Ctrl+Q)"

echo "--- capture ---"
printf '%s\n' "$screen"
((status == 0)) && echo "PASS: answer and tok/s shown in a real terminal"
exit $status
