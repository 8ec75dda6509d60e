//! `awcp-ctl token …`: client credentials kept (hashed) in the daemon's state database,
//! which every daemon of a shared PostgreSQL database accepts (see
//! `awcp_ctl::daemon::tokens`).

use std::process::ExitCode;

use clap::Subcommand;

use awcp_ctl::client::DaemonClient;

#[derive(Debug, Subcommand)]
pub(super) enum TokenCommand {
    /// Make a client token and print it (the only time it is shown). Every daemon sharing
    /// this daemon's database (`serve --state postgres://…`) accepts it, so a client given
    /// several daemons (`--daemon URL1,URL2`) keeps working when one dies. Give it to
    /// clients in AWCP_API_TOKEN or a file for --api-token-file.
    Create {
        /// What it is for (a person, a CI job), shown by `token list`.
        #[arg(long, default_value = "")]
        label: String,
    },
    /// List the client tokens (ids, labels, dates; never the tokens).
    List,
    /// Delete a client token: every daemon refuses it within 5 seconds.
    Delete {
        /// Its id (`tok_…`).
        id: String,
    },
}

pub(super) async fn run(
    cmd: TokenCommand,
    json: bool,
    client: &DaemonClient,
) -> anyhow::Result<ExitCode> {
    match cmd {
        TokenCommand::Create { label } => {
            let t = client.create_token(&label).await?;
            if json {
                println!("{}", serde_json::to_string(&t)?);
            } else {
                println!("{}", t.token);
                eprintln!(
                    "client token {} made; it is shown only now. {}",
                    t.id,
                    if t.shared {
                        "Every daemon of this shared database accepts it."
                    } else {
                        "This daemon accepts it (its state is not shared with other daemons)."
                    }
                );
            }
        }
        TokenCommand::List => {
            let l = client.tokens().await?;
            if json {
                for t in &l.tokens {
                    println!("{}", serde_json::to_string(t)?);
                }
            } else if l.tokens.is_empty() {
                println!("no client tokens (`awcp-ctl token create` makes one)");
            } else {
                println!("{:<21} {:<25} LABEL", "ID", "CREATED");
                for t in &l.tokens {
                    println!("{:<21} {:<25} {}", t.id, t.created_at, t.label);
                }
            }
        }
        TokenCommand::Delete { id } => {
            client.delete_token(&id).await?;
            if json {
                println!("{}", serde_json::json!({"ok": true, "id": id}));
            } else {
                println!("deleted client token {id}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
