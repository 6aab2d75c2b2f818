//! A database password that is a Microsoft Entra token of the app's managed identity
//! (`<connection>__credential = managedidentity`, see `config::db_identity`).
//!
//! A target's token is asked for before each question a source puts to the database
//! ([`super::pools::Gate::enter`]) and by a stream before it connects; it is kept while the rule of
//! [`crate::domain::token`] says so, and a new one replaces it in the pool's connect options, so
//! that the connections the pool opens from then on log in with it (those already open stay: the
//! server checked them when they logged in). The token is a [`Secret`]: never logged, shown or
//! stored, and the errors say where it came from, never what it is.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use azure_core::credentials::TokenCredential;

use super::SourceError;
use crate::config::DatabaseIdentity;
use crate::domain::token::{TokenUse, token_use};
use crate::settings::Secret;

/// The audience of Azure Database for PostgreSQL and for MySQL (Entra's "OSS RDBMS" resource).
pub const DATABASE_SCOPE: &str = "https://ossrdbms-aad.database.windows.net/.default";

/// The token one database target logs in with.
pub struct DatabaseToken {
    identity: DatabaseIdentity,
    credential: Mutex<Option<Arc<dyn TokenCredential>>>,
    kept: Mutex<Option<Kept>>,
    /// One request for a new token at a time: the questions that find it due wait for that one.
    asking: tokio::sync::Mutex<()>,
}

#[derive(Clone)]
struct Kept {
    token: Secret,
    expires_at: SystemTime,
    /// Counts the tokens this target was given, so that a pool knows whether it has the latest.
    generation: u64,
}

/// The token to log in with, and which of the target's tokens it is.
pub struct Password {
    pub token: Secret,
    pub generation: u64,
}

impl DatabaseToken {
    pub fn new(identity: DatabaseIdentity) -> Self {
        DatabaseToken {
            identity,
            credential: Mutex::new(None),
            kept: Mutex::new(None),
            asking: tokio::sync::Mutex::new(()),
        }
    }

    /// The token kept now, if any (what a pool made at this moment logs in with).
    pub fn kept(&self) -> Option<Password> {
        let kept = self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        kept.as_ref().map(|kept| Password { token: kept.token.clone(), generation: kept.generation })
    }

    /// The token to open connections with at `now`: the one kept, or a new one from the managed
    /// identity when the kept one is due ([`token_use`]). `location` names the database in errors.
    pub async fn password(&self, now: SystemTime, location: &str) -> Result<Password, SourceError> {
        if let Some(password) = self.usable(now) {
            return Ok(password);
        }
        let _asking = self.asking.lock().await;
        // Another question may have renewed it while this one waited.
        if let Some(password) = self.usable(now) {
            return Ok(password);
        }
        let credential = self.credential().map_err(|reason| self.failed(location, reason))?;
        let token = credential
            .get_token(&[DATABASE_SCOPE], None)
            .await
            .map_err(|error| self.failed(location, error.to_string()))?;
        let mut kept = self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let generation = kept.as_ref().map_or(1, |kept| kept.generation + 1);
        let next = Kept {
            token: Secret::new(token.token.secret()),
            expires_at: SystemTime::from(token.expires_on),
            generation,
        };
        *kept = Some(next.clone());
        Ok(Password { token: next.token, generation })
    }

    fn usable(&self, now: SystemTime) -> Option<Password> {
        let kept = self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let current = kept.as_ref()?;
        match token_use(Some(current.expires_at), now) {
            TokenUse::Keep => Some(Password { token: current.token.clone(), generation: current.generation }),
            TokenUse::Refresh => None,
        }
    }

    fn credential(&self) -> Result<Arc<dyn TokenCredential>, String> {
        let mut credential = self.credential.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(credential) = credential.as_ref() {
            return Ok(credential.clone());
        }
        let made = crate::azure::managed_identity(self.identity.client_id.clone())?;
        *credential = Some(made.clone());
        Ok(made)
    }

    fn failed(&self, location: &str, reason: String) -> SourceError {
        SourceError::NoToken { location: location.to_string(), setting: self.identity.setting.clone(), reason }
    }
}
