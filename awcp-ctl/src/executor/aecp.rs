//! AECP on the Executor: witnesses run here, inside the worker's mount.
//!
//! `POST /awcp/tasks/{id}/aecp/witness` (behind the delegation's proof, like every task route)
//! runs a witness in the task's mount directory (`?resource=NAME`: that resource's mount,
//! when the delegation has several) with a timeout, in its own process group,
//! as the agent's user (`executor --agent-user`; else the Executor's own, which is then the
//! agent's) and — where the machine allows — a new network namespace, and answers the run. The
//! Delegator's daemon calls it on publication and on a flag; nothing runs on the Delegator's
//! machine.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use aecp_hooks::knowledge::Witness;
use aecp_hooks::witness::{RunSpec, run};
use awcp_protocol::AssignmentState;

use super::Executor;

fn fail(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": msg.into() }))).into_response()
}

/// `?resource=NAME`: with several resources, the mount the witness runs in.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct WitnessQuery {
    #[serde(default)]
    resource: Option<String>,
}

/// `POST /awcp/tasks/{id}/aecp/witness[?resource=NAME]`.
pub(super) async fn witness(
    State(ex): State<Arc<Executor>>,
    Path(id): Path<String>,
    Query(q): Query<WitnessQuery>,
    body: Result<Json<Witness>, JsonRejection>,
) -> Response {
    let w = match body {
        Ok(Json(w)) => w,
        Err(rej) => {
            return fail(
                StatusCode::BAD_REQUEST,
                format!("malformed witness: {}", rej.body_text()),
            );
        }
    };
    if let Err(e) = w.validate() {
        return fail(StatusCode::BAD_REQUEST, e.to_string());
    }
    let Some(a) = ex.tasks.lock().get(&id).cloned() else {
        return fail(
            StatusCode::NOT_FOUND,
            format!("no task {id} on this Executor"),
        );
    };
    let running = matches!(
        *a.state.lock(),
        AssignmentState::Active | AssignmentState::Idle
    ) && a.mount.lock().is_some();
    if !running {
        return fail(
            StatusCode::CONFLICT,
            format!("task {id} has no mount now: a witness runs in a running task's mount"),
        );
    }
    // As the agent's user when the Executor runs agents as one (`--agent-user`): a witness
    // is the agent's command and gets the agent's rights, never the Executor's.
    // With several resources, each is mounted at `<workDir>/<name>`: the worker is one of
    // them (a plain name only: it never leaves the work directory).
    let dir = match q.resource.as_deref() {
        None => a.work_path.clone(),
        Some(name)
            if !name.is_empty()
                && name != "."
                && name != ".."
                && !name.contains(['/', '\\', '\0'])
                && a.work_path.join(name).is_dir() =>
        {
            a.work_path.join(name)
        }
        Some(name) => {
            return fail(
                StatusCode::NOT_FOUND,
                format!("task {id} has no resource {name:?} to run a witness in"),
            );
        }
    };
    let spec = RunSpec {
        dir,
        user: ex.cfg.agent_user.as_ref().map(|u| (u.uid, u.gid)),
        isolate_network: true,
    };
    match tokio::task::spawn_blocking(move || run(&w, &spec)).await {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => fail(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
        Err(e) => fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("witness task failed: {e}"),
        ),
    }
}
